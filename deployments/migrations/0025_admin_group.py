from django.db import migrations


def create_admin_group(apps, schema_editor):
    """The third role's group: docs/security.md names it, and an admin gave it to a user only after making it."""
    apps.get_model("auth", "Group").objects.get_or_create(name="admin")


class Migration(migrations.Migration):
    dependencies = [("deployments", "0024_node_listeners"), ("auth", "0012_alter_user_first_name_max_length")]
    operations = [migrations.RunPython(create_admin_group, migrations.RunPython.noop)]
