"""recjax: embedding compression for deep-learning recommendation models in JAX/Flax."""

import pathlib

from setuptools import find_packages, setup

HERE = pathlib.Path(__file__).parent

setup(
    name="recjax",
    version="0.1.0",
    description="JAX/Flax framework for embedding compression in recommendation models",
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["recjax*", "compression*", "pallas_kernels*", "experiments*"]),
    install_requires=[
        # Every lower bound is what the code needs, found by installing exactly these minimums (with jaxlib == jax) in
        # a throwaway venv and training (tests/test_min_versions.py, slow). jax 0.10.x is the newest on Python 3.11;
        # 0.9.2: pallas_kernels/hardware.py reads the TPU chips' budgets (pltpu.get_tpu_info_for_chip), traced even
        # on a CPU (lax.platform_dependent traces every branch).
        "jax>=0.9.2,<0.12",
        "flax>=0.10,<0.14",
        "optax>=0.2.4,<0.4",
        "ml_collections>=1.0,<2",  # recjax/cli.py: config_flags.register_flag_parser_for_type
        "absl-py>=2.0,<3",
        "numpy>=2.0,<3",  # jax 0.9.2's own minimum
        "tensorboardX>=2.6.2.2,<3",  # 2.6 caps protobuf < 4, which grain's protobuf >= 5.28 excludes
        "tqdm>=4.66,<5",
        # Prepared real datasets: TFDS builders writing array_record, read without TensorFlow via Grain; 4.9.10: the
        # first to read its dataset_info with protobuf 7 (FieldDescriptor.label is gone).
        "tensorflow-datasets>=4.9.10,<5",
        # recjax/data/tabular*.py: CSV parsing (invalid_row_handler), Parquet, Arrow compute; 16: built for numpy 2.
        "pyarrow>=16",
        "array_record>=0.8",  # grain 0.2.12's minimum
        "grain>=0.2.12,<0.3",
        "importlib_resources>=5",  # TFDS (via etils.epath) needs it to locate builder code; not always pulled in
        "matplotlib>=3.8.4,<4",  # 3.8.0-3.8.3 cap numpy < 2
        # recjax/checkpoint/: CheckpointManager, StandardSave / JsonSave items, read_only managers; 0.11.34: the
        # ParamInfo.await_path_creation the streamed tables' handler reads with (recjax/checkpoint/streamed.py).
        "orbax-checkpoint>=0.11.34,<0.13",
        # recjax/serving/export.py: jax.export serializes an exported model with flatbuffers (not a jax dependency).
        "flatbuffers>=23.1.4",  # the first 23.x
    ],
    extras_require={
        # python -m experiments.serve (recjax/serving/server.py): the asyncio HTTP server (and the load generator's
        # client, benchmarks/serving.py) and the /metrics exposition.
        "serve": ["aiohttp>=3.9,<4", "prometheus_client>=0.20,<1"],
        # The TensorBoard viewer for the event files every run writes (`tensorboard --logdir runs`).
        "tensorboard": ["tensorboard>=2.16,<3"],
        "test": [
            "pytest>=8,<10",
            # pytest.ini runs the suite on 2 worker processes, one test file each at a time (most of a test's time is
            # XLA compiling, one thread per compile): 9:17 -> 6:05 on 2 cores.
            "pytest-xdist>=3.5,<4",
            "scikit-learn>=1.4,<2",
            "ruff>=0.6",
            # tests/test_sweep_compression.py executes experiments/notebooks/compression_pareto.ipynb
            "nbformat>=5.9,<6",
            "nbclient>=0.9,<1",
            "ipykernel>=6.25,<8",
            # tests/test_serving_server.py runs the server (the "serve" extra)
            "aiohttp>=3.9,<4",
            "prometheus_client>=0.20,<1",
        ],
    },
)
