"""Builds the extension mha._core with the project's CMake (see pyproject.toml for how to install)."""
import os
import pathlib
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = pathlib.Path(__file__).resolve().parent


class CMakeBuild(build_ext):
    """Configures and builds the _core target, then copies the module where setuptools expects it."""

    def build_extension(self, ext):
        build_dir = pathlib.Path(self.build_temp).resolve() / "cmake"
        subprocess.check_call([
            "cmake", "-S", str(ROOT), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
            f"-DPython_EXECUTABLE={sys.executable}", "-DMHA_BUILD_APPS=OFF", "-DMHA_BUILD_TESTS=OFF", "-Wno-dev"])
        subprocess.check_call(["cmake", "--build", str(build_dir), "--target", "_core", "-j", str(os.cpu_count() or 2)])
        built = next((build_dir / "python" / "mha").glob("_core*.so"))
        target = pathlib.Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built, target)


setup(ext_modules=[Extension("mha._core", sources=[])], cmdclass={"build_ext": CMakeBuild})
