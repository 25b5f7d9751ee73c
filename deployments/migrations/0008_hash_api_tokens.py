"""API tokens made before hashing: keep each one working, but store only its digest (plumbing/tokens.py)."""
import hashlib

from django.db import migrations


def hash_keys(apps, schema_editor):
    Token = apps.get_model("authtoken", "Token")
    for token in list(Token.objects.all()):
        digest = hashlib.sha256(token.key.encode()).hexdigest()[:40]
        Token.objects.filter(pk=token.pk).delete()  # the key is the primary key: a new row, then
        Token.objects.create(key=digest, user_id=token.user_id, created=token.created)


class Migration(migrations.Migration):
    dependencies = [("deployments", "0007_ownership_and_faults"), ("authtoken", "0004_alter_tokenproxy_options")]
    operations = [migrations.RunPython(hash_keys, migrations.RunPython.noop)]
