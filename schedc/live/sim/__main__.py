"""``python -m schedc.live.sim``: a campaign of simulated runs (see `schedc.live.sim.run`)."""

from schedc.live.sim.campaign import main

raise SystemExit(main())
