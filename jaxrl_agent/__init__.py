"""jaxrl_agent: a JAX-native, functional trainer for agentic RL of LLM policies."""

__version__ = "0.1.0"
