"""Template tags of the deployments pages: Grafana links, the node badges, the host doctor and the context fit.
An inclusion tag computes what it shows from the page's context and may read through a service; it never writes.
May import the deployments app and plumbing; never controlpanel."""
