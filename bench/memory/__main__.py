from bench.memory.run import main

raise SystemExit(main())
