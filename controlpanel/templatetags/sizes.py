"""One size convention on every page: binary units named as such (GiB, MiB), as the JS writes them."""
from django import template

register = template.Library()


@register.filter
def gib(value) -> str:
    """1610612736 -> "1.5 GiB"; under a GiB in MiB, so a small model does not read "0.0 GiB"."""
    try:
        size = int(value or 0)
    except (TypeError, ValueError):
        return "—"
    if size >= 2**30:
        return f"{size / 2**30:,.1f} GiB"
    return f"{size / 2**20:,.1f} MiB"
