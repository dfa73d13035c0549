from cni_agent.cli.cli import main

raise SystemExit(main())
