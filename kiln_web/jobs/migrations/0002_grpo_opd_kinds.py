from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('jobs', '0001_initial'),
    ]

    operations = [
        migrations.AlterField(
            model_name='trainingjob',
            name='kind',
            field=models.CharField(choices=[('sft', 'SFT'), ('grpo', 'GRPO'), ('opd', 'OPD')], max_length=16),
        ),
    ]
