from cni_agent.cli.commands import main

raise SystemExit(main())
