"""pdserve: disaggregated prefill/decode LLM serving.

Every package installs under this namespace (``pdserve.engine``, ``pdserve.gateway``, ...);
their folders stay at the top of the repository, mapped in pyproject.toml. ``pdserve.envs``,
the environment variables every role reads, lives here.
"""

__version__ = "0.1.0"
