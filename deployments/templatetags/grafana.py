"""Links from the panel's pages to the matching Grafana dashboard (monitoring/grafana/dashboards),
shown only when GRAFANA_URL is set."""
from urllib.parse import urlencode

from django import template
from django.conf import settings

register = template.Library()
# Page kind -> (dashboard uid, the dashboard variable that selects the thing shown).
DASHBOARDS = {"node": ("panel-fleet", "node"), "deployment": ("panel-deployment", "deployment")}


@register.simple_tag
def grafana_url(kind: str, name: str) -> str:
    """The dashboard of a node or deployment in Grafana, or "" when no Grafana is configured."""
    if not settings.GRAFANA_URL:
        return ""
    uid, variable = DASHBOARDS[kind]
    return f"{settings.GRAFANA_URL}/d/{uid}/?{urlencode({f'var-{variable}': name})}"
