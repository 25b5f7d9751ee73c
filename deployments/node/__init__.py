"""Node-side deployment code: what runs on a GPU host's agent."""
