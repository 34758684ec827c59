"""mhgpo: end-to-end reinforcement learning of LLM-driven multi-agent search systems."""

__version__ = "0.1.0"
