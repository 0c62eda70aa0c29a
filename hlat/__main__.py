from hlat.cli import main

raise SystemExit(main())
