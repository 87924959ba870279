from conductor.cli import main

raise SystemExit(main())
