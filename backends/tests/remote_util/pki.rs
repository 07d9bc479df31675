//! A CA and certificates made at test time with the openssl crate.

use openssl::asn1::Asn1Time;
use openssl::bn::BigNum;
use openssl::hash::MessageDigest;
use openssl::pkey::{PKey, Private};
use openssl::rsa::Rsa;
use openssl::x509::extension::{BasicConstraints, SubjectAlternativeName};
use openssl::x509::{X509NameBuilder, X509};
use std::path::{Path, PathBuf};

pub struct Issued {
    pub cert: PathBuf,
    pub key: PathBuf,
}

fn key() -> PKey<Private> {
    PKey::from_rsa(Rsa::generate(2048).unwrap()).unwrap()
}

fn build(
    cn: &str,
    pkey: &PKey<Private>,
    issuer: Option<(&X509, &PKey<Private>)>,
    ca: bool,
    ips: &[&str],
    serial: u32,
) -> X509 {
    let mut name = X509NameBuilder::new().unwrap();
    name.append_entry_by_text("CN", cn).unwrap();
    let name = name.build();
    let mut b = X509::builder().unwrap();
    b.set_version(2).unwrap();
    b.set_serial_number(&BigNum::from_u32(serial).unwrap().to_asn1_integer().unwrap())
        .unwrap();
    b.set_subject_name(&name).unwrap();
    match issuer {
        Some((c, _)) => b.set_issuer_name(c.subject_name()).unwrap(),
        None => b.set_issuer_name(&name).unwrap(),
    }
    b.set_pubkey(pkey).unwrap();
    b.set_not_before(&Asn1Time::days_from_now(0).unwrap())
        .unwrap();
    b.set_not_after(&Asn1Time::days_from_now(2).unwrap())
        .unwrap();
    if ca {
        b.append_extension(BasicConstraints::new().critical().ca().build().unwrap())
            .unwrap();
    }
    if !ips.is_empty() {
        let mut san = SubjectAlternativeName::new();
        for ip in ips {
            san.ip(ip);
        }
        let ext = san
            .build(&b.x509v3_context(issuer.map(|(c, _)| &**c), None))
            .unwrap();
        b.append_extension(ext).unwrap();
    }
    b.sign(issuer.map_or(pkey, |(_, k)| k), MessageDigest::sha256())
        .unwrap();
    b.build()
}

pub struct Pki {
    pub ca: PathBuf,
    ca_cert: X509,
    ca_key: PKey<Private>,
    dir: PathBuf,
    serial: u32,
}

impl Pki {
    /// A CA named `name` in `dir`.
    pub fn new(dir: &Path, name: &str) -> Pki {
        let k = key();
        let c = build(name, &k, None, true, &[], 1);
        let ca = dir.join(format!("{name}-ca.pem"));
        std::fs::write(&ca, c.to_pem().unwrap()).unwrap();
        Pki {
            ca,
            ca_cert: c,
            ca_key: k,
            dir: dir.to_path_buf(),
            serial: 2,
        }
    }

    /// A certificate for `cn` (with IP SANs) signed by this CA.
    pub fn issue(&mut self, cn: &str, ips: &[&str]) -> Issued {
        let k = key();
        self.serial += 1;
        let c = build(
            cn,
            &k,
            Some((&self.ca_cert, &self.ca_key)),
            false,
            ips,
            self.serial,
        );
        let cert = self.dir.join(format!("{cn}.pem"));
        let keyp = self.dir.join(format!("{cn}.key"));
        std::fs::write(&cert, c.to_pem().unwrap()).unwrap();
        std::fs::write(&keyp, k.private_key_to_pem_pkcs8().unwrap()).unwrap();
        Issued { cert, key: keyp }
    }
}
