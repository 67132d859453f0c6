"""Background work of the gateway: maintenance now; turns and delivery next."""
