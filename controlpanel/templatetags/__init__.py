"""Template filters shared by every page (sizes, durations, engine flags as the user reads them).
Part of the wiring: may import the apps' plain helpers and plumbing.
Nothing below the wiring imports these filters."""
