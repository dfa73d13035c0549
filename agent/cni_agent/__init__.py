"""cni-agent: a node agent that owns CNI networking."""

__version__ = "0.1.0"
