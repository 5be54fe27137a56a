"""What every owned row shares: "owner or staff" written once, as `visible_to(user)` on its queryset and
`is_owner_or_staff(user)` on the row (the control plane's apps own their models). A queryset whose rows can be
shared (adapters) widens `visible_to` with `shared_with(user)`; `managed_by(user)` stays owner-or-staff."""

from django.db import models
from django.db.models import Q


class OwnedQuerySet(models.QuerySet):
    """Rows with an owner; OWNER_FIELD is the lookup to it (a subclass may reach it through a relation)."""

    owner_field = "owner"

    def visible_to(self, user):
        """USER's own rows and those shared with USER; every row for staff."""
        if user.is_staff:
            return self
        shared = self.shared_with(user)
        if shared is None:
            return self.filter(**{self.owner_field: user})
        return self.filter(Q(**{self.owner_field: user}) | shared).distinct()

    def managed_by(self, user):
        """USER's own rows; every row for staff (what USER may change, whatever is shared)."""
        return self if user.is_staff else self.filter(**{self.owner_field: user})

    def shared_with(self, user) -> Q | None:
        """The condition for rows shared with USER beyond their own; None: rows of this kind are not shared."""
        return None


class Owned:
    """A mixin for a model with an `owner` foreign key."""

    def is_owner_or_staff(self, user) -> bool:
        return self.owner_id == user.pk or user.is_staff
