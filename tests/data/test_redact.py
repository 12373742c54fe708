"""National identifiers, company tax numbers, IBANs and URL credentials out of traffic text (sources/redact.py):
each planted value is redacted and counted once under its kind; a number of the same shape whose check digits
fail is kept (an order number is no CPF); a credential in a URL is no e-mail address; a dotted quad that is a
version, and an SSN-shaped number after an order word, are kept (issue 58)."""

from __future__ import annotations

import pytest
from stdnum import iban, verhoeff
from stdnum.br import cnpj, cpf
from stdnum.cn import ric
from stdnum.es import dni, nie
from stdnum.eu import vat
from stdnum.fr import nir
from stdnum.in_ import aadhaar, pan
from stdnum.it import codicefiscale
from stdnum.mx import curp
from stdnum.us import ssn

from eagle3_assets.sources.redact import KINDS, Redactor

# (kind, value, its validator, a sentence it stands in): check digits computed, or published test numbers
PLANTED = [
    ("national_id", cpf.format("529982247" + cpf._calc_check_digits("529982247")), cpf,
     "Olá, meu CPF é {} e preciso da segunda via do boleto."),
    ("national_id", "52998224725", cpf, "CPF sem pontuação: {}; pode conferir?"),
    ("company_id", cnpj.format("112223330001" + cnpj.calc_check_digits("112223330001")), cnpj,
     "A nota fiscal sai no CNPJ {}, por favor."),
    ("national_id", "536-22-1847", ssn, "My SSN is {} and the form keeps rejecting it."),
    ("iban", "IT60 X054 2811 1010 0000 0123 456", iban, "Il mio IBAN è {} PER FAVORE controlla il bonifico."),
    ("iban", "BR1500000000000010932840814P2", iban, "Transferência para o IBAN {}."),
    ("company_id", "IT00743110157", vat, "Fattura intestata a P.IVA {}, grazie."),
    ("company_id", "DE 136 695 976", vat, "Our VAT number is {}."),
    ("national_id", aadhaar.format("23456789012" + verhoeff.calc_check_digit("23456789012")), aadhaar,
     "Aadhaar {} is linked to my bank account."),
    ("national_id", "AAPFU0939F", pan, "Please update PAN {} on the invoice."),
    ("national_id", "RSSMRA85T10A562S", codicefiscale, "Il codice fiscale è {}."),
    ("national_id", "12345678Z", dni, "Mi DNI es {}."),
    ("national_id", "X1234567L", nie, "Mi NIE es {}."),
    ("national_id", "2 95 10 99 126 111 93", nir, "Mon numéro de sécurité sociale : {}."),
    ("national_id", "BOXW310820HNERXN09", curp, "Mi CURP es {}."),
    ("national_id", "11010519491231002X", ric, "身份证号 {} 。"),
]


@pytest.mark.parametrize("kind, value, validator, sentence", PLANTED, ids=[f"{p[0]}:{p[1]}" for p in PLANTED])
def test_each_planted_identifier_is_redacted_and_counted_once(kind, value, validator, sentence):
    assert validator.is_valid(value)  # the plant is a real one
    text, found = Redactor().redact(sentence.format(value))
    assert text == sentence.format(f"[{kind.upper()}]") and found == {kind: 1}


# Same shapes, check digits off by one (or, for the SSN, which has none, an area never issued): left as written
LOOK_ALIKES = [
    "Pedido 529.982.247-26 enviado; rastreio 52998224726.", "CNPJ errado 11.222.333/0001-82.",
    "Ticket 000-12-3456 and 666-12-3456 were closed.", "Ordine 2345 6789 0125 spedito ieri.",
    "IBAN sbagliato IT61 X054 2811 1010 0000 0123 456.", "P.IVA IT00743110158 non valida.",
    "Codice RSSMRA85T10A562T.", "Order 100234587, invoice 20261127001, build 202611301022, ref ABCDE1234F.",
    "Serial 2 95 10 99 126 111 00 and 11010519491231002Y and 12345678A.",
]


@pytest.mark.parametrize("text", LOOK_ALIKES)
def test_numbers_shaped_like_identifiers_whose_check_digits_fail_are_kept(text):
    assert Redactor().redact(text) == (text, {})


def test_a_credential_in_a_url_is_its_own_kind_and_keeps_scheme_and_host():
    token, password = "ghp_Xq7vB2nLk9PzR4tWm8YcJd3FxK1LpQ0aB", "S3cr3t@Pass"
    text, found = Redactor().redact(
        f"Clone https://{token}@github.com/acme/app.git, then set DATABASE_URL=postgres://admin:{password}@db.example"
        ".com:5432/app and mail jane.doe@example-mail.com or ops@example.org if it fails.")
    assert token not in text and password not in text and "admin" not in text
    assert "https://[URL_CREDENTIAL]@github.com/acme/app.git" in text
    assert "postgres://[URL_CREDENTIAL]@db.example.com:5432/app" in text
    assert found == {"url_credential": 2, "email": 2}  # each address once; no credential read as an address
    assert {"url_credential", "national_id", "company_id", "iban"} <= set(KINDS)  # each reaches redacted_<kind>


# Issue 58: what a prompt about software or an order carries is no personal data, and stays in the training text.
VERSIONS = ["Upgraded to version 4.10.2.7 and the build broke.", "Build: 1.2.3.4 fails, Release 10.0.0.5 works.",
            "ver 2.0.0.1 and v4.10.2.7 and V 1.2.3.4", "pip install 'foo==4.10.2.7' 'bar>=1.2.3.4' 'baz~=10.0.0.5'",
            "npm i foo@1.2.3.4 @scope/bar@10.0.0.5", "Download foo-1.2.3.4.tar.gz or foo-1.2.3.4-py3-none-any.whl."]
ADDRESSES = [("10.0.0.5", "[IP_ADDRESS]"), ("connect to 192.168.1.20", "connect to [IP_ADDRESS]"),
             ("ssh root@10.0.0.5", "ssh root@[IP_ADDRESS]"), ("git@10.0.0.5:app.git", "git@[IP_ADDRESS]:app.git"),
             ("hosts 10.0.0.1-10.0.0.9 and server-10.0.0.5", "hosts [IP_ADDRESS]-[IP_ADDRESS] and server-[IP_ADDRESS]"),
             ("the version on 10.0.0.5", "the version on [IP_ADDRESS]")]


@pytest.mark.parametrize("text", VERSIONS)
def test_a_dotted_quad_that_is_a_version_is_kept(text):
    assert Redactor().redact(text) == (text, {})


@pytest.mark.parametrize("text, redacted", ADDRESSES)
def test_a_dotted_quad_that_is_an_address_is_still_redacted(text, redacted):
    assert Redactor().redact(text) == (redacted, {"ip_address": redacted.count("[IP_ADDRESS]")})


# SSN-shaped numbers that stdnum accepts (an SSN has no check digit: its shape and its ranges are all there is)
ORDER_IDS = ["Order #482-19-7305 shipped", "Invoice no. 482-19-7305 is overdue", "tracking number: 482-19-7305",
             "Ref 482-19-7305, ticket 536-22-1847 and case #482-19-7305", "PO 482-19-7305 / SKU 536-22-1847",
             "#482-19-7305 and No. 536-22-1847"]
PERSONAL = ["My SSN is 482-19-7305, please update it.", "SSN #482-19-7305", "social security no. 482-19-7305",
            "482-19-7305", "Her number is 482-19-7305 and mine is 536-22-1847."]


@pytest.mark.parametrize("text", ORDER_IDS)
def test_an_ssn_shaped_number_after_an_order_word_is_an_order_id_and_is_kept(text):
    assert all(ssn.is_valid(n) for n in ("482-19-7305", "536-22-1847"))  # shaped and ranged as SSNs
    assert Redactor().redact(text) == (text, {})


@pytest.mark.parametrize("text", PERSONAL)
def test_an_ssn_in_a_personal_context_is_still_redacted(text):
    redacted, found = Redactor().redact(text)
    assert "482-19-7305" not in redacted and "536-22-1847" not in redacted
    assert found == {"national_id": redacted.count("[NATIONAL_ID]")} and "[NATIONAL_ID]" in redacted
