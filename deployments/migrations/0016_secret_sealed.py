"""Encrypt a Hugging Face token stored before encryption at rest existed (issue 25 item 6)."""
from django.db import migrations


def seal_plaintext(apps, schema_editor):
    from deployments import sealed

    for row in apps.get_model("deployments", "Secret").objects.all():
        if row.value and not sealed.is_sealed(row.value):
            row.value = sealed.seal(row.value)
            row.save(update_fields=["value"])


def unseal(apps, schema_editor):
    """Back to plain text, for a downgrade to code that cannot read sealed values."""
    from deployments import sealed

    for row in apps.get_model("deployments", "Secret").objects.all():
        if sealed.is_sealed(row.value):
            row.value = sealed.unseal(row.value)
            row.save(update_fields=["value"])


class Migration(migrations.Migration):
    dependencies = [("deployments", "0015_deployment_ray_token")]

    operations = [migrations.RunPython(seal_plaintext, unseal)]
