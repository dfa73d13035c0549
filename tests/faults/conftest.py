from tests.daemon.conftest import (  # noqa: F401
    bridge_chain,
    bridge_name,
    make_agent,
    open_dir,
    permissive_bus,
    system_bus,
    testnet,
)
