"""One item of the Price List API's ``GetProducts`` answer, as AWS returns it: a JSON document
with the product's attributes and ``terms.OnDemand.<sku>.<offer>.priceDimensions`` (the AWS CLI
reference's get-products example). The EC2 and SageMaker price tests build theirs here."""

from __future__ import annotations

import json
from collections.abc import Mapping


def price_list_item(
    *,
    service: str,
    family: str,
    attributes: Mapping[str, str],
    sku: str,
    usd: str,
    description: str,
    effective: str,
) -> str:
    """``usd`` per hour On-Demand for one product of ``service`` (``servicecode`` added to its
    ``attributes``), its term effective from ``effective`` (``YYYY-MM-DD``)."""
    offer, dimension = f"{sku}.JRTCKXETXF", f"{sku}.JRTCKXETXF.6YS6EN2CT7"
    stamp = f"{effective}T00:00:00Z"
    return json.dumps(
        {
            "product": {
                "productFamily": family,
                "attributes": {**attributes, "servicecode": service},
                "sku": sku,
            },
            "serviceCode": service,
            "terms": {
                "OnDemand": {
                    offer: {
                        "priceDimensions": {
                            dimension: {
                                "unit": "Hrs",
                                "endRange": "Inf",
                                "description": description,
                                "appliesTo": [],
                                "rateCode": dimension,
                                "beginRange": "0",
                                "pricePerUnit": {"USD": usd},
                            }
                        },
                        "sku": sku,
                        "effectiveDate": stamp,
                        "offerTermCode": "JRTCKXETXF",
                        "termAttributes": {},
                    }
                }
            },
            "version": effective.replace("-", "") + "000000",
            "publicationDate": stamp,
        }
    )
