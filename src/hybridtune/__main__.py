from hybridtune.cli import main

raise SystemExit(main())
