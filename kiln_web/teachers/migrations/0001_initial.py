import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):

    initial = True

    dependencies = [
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.CreateModel(
            name='TeacherAlias',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('name', models.CharField(help_text='name@route, e.g. tutor@native', max_length=120, unique=True)),
                ('route', models.CharField(choices=[('native', 'native'), ('openai', 'OpenAI-compatible')], help_text="the part after '@'", max_length=16)),
                ('base', models.CharField(blank=True, help_text='native: a registered base (kiln base list)', max_length=100)),
                ('adapter', models.CharField(blank=True, help_text='native, optional: a PEFT adapter directory in the adapter registry or a data root (absolute)', max_length=1000)),
                ('endpoint', models.CharField(blank=True, help_text='openai: the server root, e.g. http://gpu-1:8000', max_length=1000)),
                ('model', models.CharField(blank=True, help_text='openai: the served model id', max_length=200)),
                ('identity_revision', models.CharField(help_text='SHA-256 of the configuration; set by Kiln', max_length=64)),
                ('content_revision', models.CharField(blank=True, help_text='the content revision the latest OPD admission reconstructed', max_length=64)),
                ('content_checked_at', models.DateTimeField(blank=True, null=True)),
                ('created_at', models.DateTimeField(auto_now_add=True)),
                ('updated_at', models.DateTimeField(auto_now=True)),
                ('owner', models.ForeignKey(on_delete=django.db.models.deletion.PROTECT, related_name='teacher_aliases', to=settings.AUTH_USER_MODEL)),
            ],
            options={
                'verbose_name': 'teacher alias',
                'verbose_name_plural': 'teacher aliases',
                'ordering': ['name'],
            },
        ),
    ]
