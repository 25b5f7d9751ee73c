from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('deployments', '0010_deployment_prewarm'),
    ]

    operations = [
        migrations.AddField(
            model_name='deployment',
            name='secret_env',
            field=models.JSONField(blank=True, default=list, help_text='Names in env the user marked secret: masked like secret-looking names.'),
        ),
    ]
