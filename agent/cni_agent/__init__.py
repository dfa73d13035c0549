"""cni-agent: a node agent that owns CNI networking."""

__version__ = "0.2.0"
