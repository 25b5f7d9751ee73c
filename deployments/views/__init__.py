"""Server-rendered pages, one module per thing they serve. Views read through selectors and change
things through services.
May import the deployments app and plumbing; never controlpanel."""
