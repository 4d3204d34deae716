"""Builds the extensions mha._core and, where MPI and mpi4py are installed, mha._distributed (ring
attention over MPI) with the project's CMake (see pyproject.toml for how to install); with _core, the
PyTorch operator library libmha_torch_ops.so (mha.torch's TorchScript path, docs/TORCH.md) where CMake
found libtorch (Debian's libtorch-dev)."""
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = pathlib.Path(__file__).resolve().parent


class CMakeBuild(build_ext):
    """Configures the project once, builds each extension's target (_core, _distributed), and copies the
    module where setuptools expects it.

    By default the build is a fresh one in pip's temporary folder. With MHA_CMAKE_BUILD_DIR naming a
    build tree that CMake has configured already (`make build`'s), the targets are built there instead:
    what that tree has compiled is reused, and the tree's configuration is left as it is (make test-pip
    does this, so that the library is not compiled a third time)."""

    def build_extension(self, ext):
        name = ext.name.split(".")[-1]
        existing = os.environ.get("MHA_CMAKE_BUILD_DIR")
        if existing:
            build_dir = pathlib.Path(existing).resolve()
            if not (build_dir / "CMakeCache.txt").exists():
                sys.exit(f"setup.py: MHA_CMAKE_BUILD_DIR={existing} is not a configured CMake build tree "
                         "(no CMakeCache.txt); run `make build`, or unset it for a fresh build")
        else:
            build_dir = pathlib.Path(self.build_temp).resolve() / "cmake"
            subprocess.check_call([
                "cmake", "-S", str(ROOT), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
                f"-DPython_EXECUTABLE={sys.executable}", "-DMHA_BUILD_APPS=OFF", "-DMHA_BUILD_TESTS=OFF", "-Wno-dev"])
        subprocess.check_call(["cmake", "--build", str(build_dir), "--target", name, "-j", str(os.cpu_count() or 2)])
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        built = build_dir / "python" / "mha" / f"{name}{suffix}"
        if not built.exists():
            sys.exit(f"setup.py: {built} was not built: the build tree was configured for another Python "
                     f"(this one, {sys.executable}, loads modules named *{suffix})")
        target = pathlib.Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built, target)
        if name == "_core":
            self._build_torch_operators(build_dir, target.parent)

    @staticmethod
    def _build_torch_operators(build_dir, package_dir):
        """Builds libmha_torch_ops.so and puts it in the package beside _core, where mha.torch loads it,
        when the CMake configuration has the target (it found libtorch); else mha.torch falls back to its
        NumPy path (not TorchScript) and says so."""
        if not (build_dir / "python" / "torch_ops").is_dir():  # CMake's directory for the target
            print("setup.py: libtorch not found by CMake: libmha_torch_ops.so (mha.torch's operators) not built")
            return
        subprocess.check_call(["cmake", "--build", str(build_dir), "--target", "mha_torch_ops",
                               "-j", str(os.cpu_count() or 2)])
        shutil.copyfile(build_dir / "python" / "mha" / "libmha_torch_ops.so", package_dir / "libmha_torch_ops.so")


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
