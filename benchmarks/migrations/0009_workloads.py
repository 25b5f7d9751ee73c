from django.conf import settings
from django.db import migrations, models
import django.db.models.deletion


class Migration(migrations.Migration):

    dependencies = [
        ('benchmarks', '0008_study_estimate_basis'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.AddField(
            model_name='benchmarkpoint',
            name='prefix_reuse',
            field=models.JSONField(blank=True, default=dict, help_text='What a prefix cache could have served of the level\'s measured prompts, from the workload\'s structure: {prompt_tokens, reusable_tokens, share}; empty for prompts without one.'),
        ),
        migrations.AlterField(
            model_name='benchmarkpoint',
            name='server_metrics',
            field=models.JSONField(default=dict, help_text="/metrics gauges scraped during the level; prefix_cache: the engine's own prefix-cache queries, hits (prompt tokens) and hit rate over the level, warm-up included."),
        ),
        migrations.CreateModel(
            name='Workload',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('name', models.CharField(max_length=100, unique=True)),
                ('kind', models.CharField(choices=[('prefix', 'Shared prefixes'), ('multiturn', 'Multi-turn conversations'), ('sharegpt', 'ShareGPT conversations'), ('trace', 'Mooncake trace')], max_length=12)),
                ('spec', models.JSONField(help_text="The runner's workload (benchmarks/runner/workloads.py), file data included.")),
                ('input_tokens', models.PositiveIntegerField(default=128, help_text='Shared prefixes: each suffix; multi-turn: each user message.')),
                ('max_tokens', models.PositiveIntegerField(default=128, help_text='Shared prefixes and multi-turn: each answer (and each made-up reply resent in the history).')),
                ('preview', models.JSONField(blank=True, default=dict, help_text="Prompt and output lengths, reuse, a trace's timing.")),
                ('created', models.DateTimeField(auto_now_add=True)),
                ('created_by', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, to=settings.AUTH_USER_MODEL)),
            ],
            options={
                'ordering': ['name'],
            },
        ),
    ]
