from batchgen.cli import main

raise SystemExit(main())
