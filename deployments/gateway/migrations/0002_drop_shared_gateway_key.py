"""The gateways' one shared key (an internal CallerKey named "gateway") gives way to one key per node pair and
hour, made where it is used (deployments/gateway/peers.py): the row is deleted, and a copy of it opens nothing."""
from django.db import migrations


def drop(apps, schema_editor):
    apps.get_model("gateway", "CallerKey").objects.filter(internal=True, name="gateway").delete()


class Migration(migrations.Migration):
    dependencies = [("gateway", "0001_initial")]
    operations = [migrations.RunPython(drop, migrations.RunPython.noop)]
