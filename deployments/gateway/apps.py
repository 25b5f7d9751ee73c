from django.apps import AppConfig


class GatewayConfig(AppConfig):
    name = "deployments.gateway"
    label = "gateway"
    verbose_name = "Gateway"
    default_auto_field = "django.db.models.BigAutoField"
