from bagualu2.sim.cli import main

raise SystemExit(main())
