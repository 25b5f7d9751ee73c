"""Server-rendered pages, one module per thing they serve. Views read through selectors and change
things through services."""
