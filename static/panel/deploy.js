// Deploy form: Deploy is off while the fit verdict shown says "does not fit" for the values shown (issue 27);
// an admin's "Deploy anyway" turns it on, and so does a change of any setting (the server checks again,
// and "Check fit" shows the new verdict).
(function () {
  const form = document.getElementById("deploy-form");
  const button = document.getElementById("deploy-submit");
  if (!form || !button || !button.dataset.fitBlocks) return;
  const override = form.querySelector('input[name="override_fit"]');
  const stale = document.getElementById("fit-stale");
  let changed = false;
  const update = () => { button.disabled = !(changed || (override && override.checked)); };
  form.addEventListener("input", (event) => {
    if (event.target === override) return update();
    changed = true;
    if (stale) stale.hidden = false;
    update();
  });
  form.addEventListener("change", (event) => { if (event.target === override) update(); });
})();
