"""What every owned row shares: "owner or staff" written once, as `visible_to(user)` on its queryset and
`is_owner_or_staff(user)` on the row (the control plane's apps own their models)."""

from django.db import models


class OwnedQuerySet(models.QuerySet):
    """Rows with an owner; OWNER_FIELD is the lookup to it (a subclass may reach it through a relation)."""

    owner_field = "owner"

    def visible_to(self, user):
        """USER's own rows; every row for staff."""
        return self if user.is_staff else self.filter(**{self.owner_field: user})


class Owned:
    """A mixin for a model with an `owner` foreign key."""

    def is_owner_or_staff(self, user) -> bool:
        return self.owner_id == user.pk or user.is_staff
