"""No models yet; the control plane's apps own theirs."""
