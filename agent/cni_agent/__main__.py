from cni_agent.main import main

raise SystemExit(main())
