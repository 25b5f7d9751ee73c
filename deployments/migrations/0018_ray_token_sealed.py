"""Seal Ray cluster tokens stored in plain text (issue 25 item 3), as 0016 did for the Hugging Face token; the
field grows first (a sealed 64-character token is 191 characters, PostgreSQL enforces the length)."""
from django.db import migrations, models


def seal_plaintext(apps, schema_editor):
    from deployments import sealed

    for row in apps.get_model("deployments", "Deployment").objects.exclude(ray_token=""):
        if not sealed.is_sealed(row.ray_token):
            row.ray_token = sealed.seal(row.ray_token)
            row.save(update_fields=["ray_token"])


def unseal(apps, schema_editor):
    """Back to plain text, for a downgrade to code that cannot read sealed values."""
    from deployments import sealed

    for row in apps.get_model("deployments", "Deployment").objects.exclude(ray_token=""):
        if sealed.is_sealed(row.ray_token):
            row.ray_token = sealed.unseal(row.ray_token)
            row.save(update_fields=["ray_token"])


class Migration(migrations.Migration):
    dependencies = [("deployments", "0017_engine_process")]

    operations = [
        migrations.AlterField(
            model_name="deployment", name="ray_token",
            field=models.CharField(blank=True, max_length=256, help_text="The Ray cluster's token (RAY_AUTH_TOKEN), new at "
                                   "each Ray head start; sealed at rest (deployments/sealed.py); write-only: never shown.")),
        migrations.RunPython(seal_plaintext, unseal),
    ]
