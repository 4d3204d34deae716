"""Builds the extensions mha._core and, where MPI and mpi4py are installed, mha._distributed (ring
attention over MPI) with the project's CMake (see pyproject.toml for how to install)."""
import os
import pathlib
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = pathlib.Path(__file__).resolve().parent


class CMakeBuild(build_ext):
    """Configures the project once, builds each extension's target (_core, _distributed), and copies the
    module where setuptools expects it."""

    def build_extension(self, ext):
        name = ext.name.split(".")[-1]
        build_dir = pathlib.Path(self.build_temp).resolve() / "cmake"
        subprocess.check_call([
            "cmake", "-S", str(ROOT), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
            f"-DPython_EXECUTABLE={sys.executable}", "-DMHA_BUILD_APPS=OFF", "-DMHA_BUILD_TESTS=OFF", "-Wno-dev"])
        subprocess.check_call(["cmake", "--build", str(build_dir), "--target", name, "-j", str(os.cpu_count() or 2)])
        built = next((build_dir / "python" / "mha").glob(f"{name}*.so"))
        target = pathlib.Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built, target)


def _has_mpi():
    """Whether mha._distributed can be built: Open MPI's compiler wrapper and mpi4py are there."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return shutil.which("mpicxx") is not None


extensions = [Extension("mha._core", sources=[])]
if _has_mpi():
    extensions.append(Extension("mha._distributed", sources=[]))
setup(ext_modules=extensions, cmdclass={"build_ext": CMakeBuild})
