from quantship.cli.main import main

raise SystemExit(main())
