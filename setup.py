"""Package discovery for pyproject.toml's `radixlm` (the repository root is the package):
every package under the product's folders, found, not listed by hand. Everything else
about the project is in pyproject.toml."""

from setuptools import find_namespace_packages, setup
from setuptools.command.build_py import build_py

PRODUCT = ("cache", "tokenizer", "runtime", "sdk", "testing")  # tests/, benchmarks/, examples/: not shipped


class BuildPy(build_py):
    """The root's modules, less this file."""

    def find_package_modules(self, package: str, package_dir: str) -> list[tuple[str, str, str]]:
        found = super().find_package_modules(package, package_dir)
        return [m for m in found if not (package == "radixlm" and m[1] == "setup")]


setup(cmdclass={"build_py": BuildPy}, packages=["radixlm", *(
    f"radixlm.{name}" for name in find_namespace_packages(include=[f"{p}*" for p in PRODUCT])
    if "__pycache__" not in name)])
