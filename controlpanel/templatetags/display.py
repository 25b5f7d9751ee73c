"""What the pages show the same way everywhere: sizes in binary units (GiB, MiB) as the JS writes them, and
engine flags as the command line."""
from django import template

from deployments.userflags import argv_words

register = template.Library()


@register.filter
def gib(value) -> str:
    """A size as every page and the JS write it (modelfit.human_bytes): "1.5 GiB", "302 MiB", "2,048 B"."""
    from deployments.modelfit import human_bytes

    try:
        return human_bytes(int(value or 0))
    except (TypeError, ValueError):
        return "—"


@register.filter
def count(value) -> str:
    """A count as people read it: 950912 -> "950,912", 8030261248 -> "8.0 billion" (humanize's intword
    leaves numbers under a million unformatted)."""
    from django.contrib.humanize.templatetags.humanize import intcomma, intword

    try:
        number = int(value)
    except (TypeError, ValueError):
        return "—"
    return intword(number) if number >= 10**6 else intcomma(number)


@register.filter
def flags(engine_args) -> str:
    """{"enforce-eager": True, "tensor-parallel-size": 1} -> "--enforce-eager --tensor-parallel-size 1", exactly as
    the engine's command line gets them (a switch has no value; 1 is a value, not True), copyable into a shell."""
    return " ".join(argv_words(engine_args or {}))


@register.filter
def percent(fraction) -> str:
    """A relative difference as a signed percentage: 0.042 -> "+4.2 %", -0.1 -> "-10.0 %"; "—" for none."""
    try:
        return f"{float(fraction) * 100:+.1f} %"
    except (TypeError, ValueError):
        return "—"
