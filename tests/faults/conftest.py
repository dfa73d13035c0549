from tests.daemon.conftest import make_agent, open_dir, permissive_bus, system_bus, testnet  # noqa: F401
