from setuptools import find_packages, setup

setup(
    name="allreduce_kit",
    version="0.1.0",
    description="AllReduce algorithms over MPI point-to-point, numba reduction kernels, and a data-parallel trainer that shows where time goes",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["allreduce_kit", "allreduce_kit.*"]),
    install_requires=[
        "mpi4py>=4.0",
        "mpich",  # MPI itself, from PyPI; see docs/install.md to use a cluster's own MPI instead
        "numpy>=1.22",
        "numba>=0.58",
        "scikit-learn",  # the bundled digits data set for the trainer; brings threadpoolctl
        "tqdm",
    ],
    extras_require={
        # torch pinned: this version installs as a CPU build; others pull several GB of CUDA libraries
        "test": ["pytest>=7", "pytest-mpi>=0.6", "hypothesis", "matplotlib", "torch==2.13.0"],
        "plot": ["matplotlib"],
        "torch": ["torch==2.13.0"],  # allreduce_kit.torch (docs/pytorch.md)
    },
)
