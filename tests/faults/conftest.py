from tests.daemon.conftest import make_agent, permissive_bus, system_bus, testnet  # noqa: F401
