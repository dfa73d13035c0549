from cni_agent.cli import main

raise SystemExit(main())
