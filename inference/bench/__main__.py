from headstart.inference.bench.run import main

raise SystemExit(main())
