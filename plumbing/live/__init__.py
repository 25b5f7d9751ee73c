"""Live updates' machinery, knowing no app: the topic registry the apps fill, publishing and kept snapshots, the
sender loop, the one WebSocket consumer and who may keep it, the fleet page's feed, the count of dropped messages.
It imports Django, Channels and plumbing only; payload shapes and senders live in each app's payloads.py."""
