"""jaxrl_agent: a JAX-native, functional trainer for agentic RL of LLM policies."""

import setuptools

setuptools.setup(
    name="jaxrl_agent",
    version="0.1.0",
    description="A JAX-native, functional trainer for agentic reinforcement learning of LLM policies.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=setuptools.find_packages(include=["jaxrl_agent", "jaxrl_agent.*"]),
    python_requires=">=3.10",
    install_requires=[
        "jax>=0.6.0",
        "flax>=0.10.4",
        "optax>=0.2.4",
        "orbax-checkpoint>=0.11.0",
        # 0.2.2 is JetStream's last release (the repository is archived); everything
        # JetStream-specific stays inside jaxrl_agent/sampling/.
        "google-jetstream>=0.2.2",
        "grain>=0.2.10",
        "chex>=0.1.89",
        "ml-collections>=1.0.0",
        "tensorflow-datasets>=4.9.8",
        "importlib_resources>=6.0",  # tensorflow-datasets needs it to read builder metadata
        "numpy>=1.26",
        "absl-py>=2.1.0",
        # Observability: TensorBoard event files and the `python -m jaxrl_agent.plot` curves.
        "tensorboard>=2.16",
        "matplotlib>=3.8",
        # Hugging Face checkpoints and tokenizers.
        "safetensors>=0.4.5",
        "tokenizers>=0.20.0",
    ],
    extras_require={
        "test": [
            "pytest>=8.0",
            "pytest-xdist>=3.5",
            "hypothesis>=6.100",
            # Reference implementations for the parity tests only (CPU build of torch).
            "transformers>=4.51",
            "torch==2.13.0",
        ],
    },
)
