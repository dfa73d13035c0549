"""`cni-agent config show` and `config check`: the daemon's own reading of its
files, without a daemon or a bus (reached through `cni_agent.main`, as `run`)."""
