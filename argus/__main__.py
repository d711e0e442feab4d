from argus.cli.main import main

raise SystemExit(main())
