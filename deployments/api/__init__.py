"""The deployments' REST API: serializers, views and URLs for nodes, models, copies, deployments and recipes.
Views validate, call one service and serialize; reads go through selectors.
May import deployments' models, selectors, services and forms' validators, and plumbing; never controlpanel."""
